"""Generate stage: which trajectories are proposed, and their shape."""
