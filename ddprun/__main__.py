from ddprun.cli import main

main()
