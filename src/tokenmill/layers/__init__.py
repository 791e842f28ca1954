"""Model building blocks shared by every architecture."""
