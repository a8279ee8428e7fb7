"""FSDP2 training and separate generation engines, one rank of a torch.distributed job."""
