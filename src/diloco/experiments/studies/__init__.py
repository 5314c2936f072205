"""The studies behind results/: each module runs one comparison (a ladder, a budget sweep, an acceptance
record), writes its record under results/, and is run as scripts/<module>.py."""
