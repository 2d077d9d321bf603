"""What tenants upload rather than the service computes: input images (``images``) and LoRA
adapters (``adapters``), kept on disk with the store's copy as their cache."""
