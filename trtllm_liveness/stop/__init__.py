"""stop."""
