"""The settings: the frozen Config in sections, presets, recipes, and what a resume may change."""
