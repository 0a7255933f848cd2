"""Where every table lives: stacking, placements, tiers, lookup profiles."""
