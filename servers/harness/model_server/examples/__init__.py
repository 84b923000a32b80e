"""Example scripts for the scripted model server (shipped as package data: `DEMO_SCRIPT`)."""
