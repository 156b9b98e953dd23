"""The ground floor: distributed set-up, crash-safe files, torch.compile's cache folder, DeepSpeed
configs, optimizers, ZeRO-3 parameter helpers, throughput numbers and running averages. Imports
nothing of dschat above it."""
