"""Tests that the manual (docs/, README.md) builds and says what the code does."""
