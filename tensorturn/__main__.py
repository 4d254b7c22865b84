from tensorturn.cli import main

main()
