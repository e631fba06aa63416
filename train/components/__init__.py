"""What a run trains with, beside its data: models by name, starting weights, the optimiser and its schedule, the EMA,
batch augmentation (the TOML presets that set them are train/recipes/)."""
