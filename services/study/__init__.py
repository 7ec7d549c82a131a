"""The paper's studies: matched comparisons of the arms (`spopp ablate`) and the map over toy-calc's knobs (`spopp map`)."""
