"""kvdrain connector package."""
