"""What this machine offers a run (its CPU's bf16 unit), probed once; the bottom layer: stdlib + torch only."""
