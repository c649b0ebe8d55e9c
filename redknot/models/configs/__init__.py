"""Each model family's parsing of an HF ``config.json``; ``models/config.py`` assembles them into
``ModelConfig``."""
