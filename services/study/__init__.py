"""The studies: matched comparisons of the arms (`spopp ablate`), the map over toy-calc's knobs
(`spopp map`) and the pre-registered comparison that sizes itself from a pilot (`spopp study compare`)."""
