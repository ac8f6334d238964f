"""System checks for afkmemory's configuration."""
