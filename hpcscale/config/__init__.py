"""Site configs and job specs: schemas, YAML loading, validation with file:line: key errors."""
