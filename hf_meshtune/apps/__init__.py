"""What runs on top of the library: the embedded default model and data (``assets``), the arithmetic
SFT task (``arithmetic``) and ``meshtune demo`` (``demo``)."""
