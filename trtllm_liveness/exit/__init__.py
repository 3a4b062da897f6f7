"""exit."""
