"""kvdrain engine package."""
