"""Model families. Everything specific to one architecture lives in one module here, so a
second family (an SD3-style image model, Qwen-Image) is a new file, not edits across the tree."""
