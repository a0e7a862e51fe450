"""The shipped evaluation manifests (one YAML file per model); see trims.evaluation.harness."""
