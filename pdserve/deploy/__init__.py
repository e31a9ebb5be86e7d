"""Deploying pdserve on cluster managers (ray/: Ray Serve)."""
