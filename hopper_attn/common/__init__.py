"""What the kernels share: the host contract, layout views, softmax, masking, tiles, TMA."""
