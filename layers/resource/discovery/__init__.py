"""Finding out what a provider's site offers, from the systems that already know (Kubernetes)."""
