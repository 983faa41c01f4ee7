"""The trainer application (`gare-train`): fitting, losses, the optimiser, evaluation, the synthetic corpus and
the import of the authors' checkpoints. Nothing else in the project imports it."""
