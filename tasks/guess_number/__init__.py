"""`guess_number`: a multi-turn game (guess 1-100, hear "too low"/"too high"); proves the merge path."""
