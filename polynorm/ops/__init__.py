"""polynorm.ops."""
