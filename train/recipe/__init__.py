"""What a run trains: models by name, starting weights, torchvision, the optimiser, the EMA, batch augmentation."""
