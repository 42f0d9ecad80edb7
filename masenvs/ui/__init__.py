"""`masenvs ui`: a local web app over training runs, their trees and conversations, auto-MAS
designs, workflow runs and eval reports (server.py serves, runs.py reads, index.py indexes;
charts, steps, calls, workflows and evals build each page's data)."""
