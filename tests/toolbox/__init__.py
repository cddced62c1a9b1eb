"""The shared test toolbox: small models, one-device references, launching ranks and scripts, comparing results."""
