"""Tests of checkpoints: full, sharded and local formats, conversion, export to safetensors, pretrained loading."""
