"""Test double of ``habana_frameworks.torch.distributed``; import ``.hccl`` to register the backend."""
