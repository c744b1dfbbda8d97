"""The image path (VISION.md): host preprocessing (`preprocess`), the ViT and aligner (`tower`), and the
batches the tower runs on (`batch`)."""
