"""A denoise worker over several ranks: its layout (how a forward is split), the wire that
hands each forward's inputs from rank 0 to the others, and the group's processes."""
