"""Sample quality: feature statistics, Frechet distance, KID, and the evaluation that produces them."""
