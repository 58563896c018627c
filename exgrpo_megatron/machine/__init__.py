"""What this machine offers a run (its CPU's bf16 unit, probed once; Transformer Engine with CUDA); the bottom layer:
stdlib + torch only."""
