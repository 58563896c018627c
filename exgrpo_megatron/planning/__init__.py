"""What a run will do and need, worked out from its validated config before anything is built: the dry run,
the model's size, the split of GPUs when generating ahead, the start-up checks against this machine."""
