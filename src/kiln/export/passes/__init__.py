"""Graph passes over kiln methods, one module each. Each keeps the method's outputs unchanged."""
