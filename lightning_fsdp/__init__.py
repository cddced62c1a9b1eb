"""lightning-fsdp."""
