"""Target and draft model definitions (Llama family), weight loading and the model runner."""
