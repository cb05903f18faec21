"""Rollout side: engines with versioned weight publication, the multi-turn agent loop, teacher scoring and the
rollout DataModule that yields ready sources."""
