"""Image inputs: preprocessing (image_processor.py) and the HTTP side's checks and prompt expansion (frontend.py)."""
