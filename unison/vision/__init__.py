"""Vision-language models: images in rows (``unison.vision.images``) and in chat messages
(``unison.vision.messages``). pillow is imported only where an image is touched: ``pip install 'unison[vision]'``."""
