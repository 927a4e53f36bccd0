"""The click CLI: commands parse, call one library function and render. No policy here."""
