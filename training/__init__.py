"""Training the built-in shapes model and its attribute classifier, on synthetic scenes."""
