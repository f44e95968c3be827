"""What a step optimises: masking, the Distiller, the output-level and layer-level losses."""
