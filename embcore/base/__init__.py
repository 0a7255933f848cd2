"""What everything stands on: torch's private APIs (one place), collectives with timeouts,
nested structures."""
