"""polynorm.core."""
