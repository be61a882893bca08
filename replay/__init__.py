"""kvdrain replay package."""
