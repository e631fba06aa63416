"""What every part of trainbox uses: the exit codes and one-line errors, bounded phases, progress lines."""
