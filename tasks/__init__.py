"""Task definitions (datasets, prompts and scoring) for agl."""
