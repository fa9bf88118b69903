"""Training of the shipped `tiny-speaker` preset: the corpus it reads (`corpus`); the command is
`python -m runner_core.train_preset`."""
