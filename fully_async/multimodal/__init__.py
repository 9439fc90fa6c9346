"""Multimodal prompts: images as compact PNG bytes (images.py), the vision processor that turns them into image
tokens and pixel inputs where they are needed (processor.py), and the built-in visual task (colors.py).

A prompt's images travel as PNG bytes (a 56x56 flat image is ~100 bytes), never as pixel tensors: the engine decodes
them itself from the request, the trainer's batch builder runs the processor on them. docs/vlm.md.
"""
